"""QDQ insertion for the HTP (docs/design.md "Numerics by construction"; paper App. A Table 3): the step and the
pipeline pass (`quantize`), over the bit-exact integer weights (`weights`), the fixed encodings and their checks
(`encodings`) and the SQNR report (`sqnr`)."""

"""The device <-> verifier protocol: frame format and codec (`wire`) and the typed messages both sides exchange
(`messages`). numpy-only: the device runtime imports it."""

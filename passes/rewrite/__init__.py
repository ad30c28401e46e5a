"""Graph rewrite rules of the compiler (onnxscript pattern rewriter), one rule per file, each with its own test."""

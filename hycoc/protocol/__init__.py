"""The device <-> verifier protocol: frame format and codec (`wire`, the public face over `layout`, `errors`, `checks`
and `codec`) and the typed messages both sides exchange (`messages`). numpy-only: the device runtime imports it."""

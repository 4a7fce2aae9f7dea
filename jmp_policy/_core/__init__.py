"""The jaxpr core and what every family shares: reading and evaluating programs (`jaxpr`),
running them by rule sets keyed by primitive (`interpreter`), what each primitive means to
mixed precision (`rules`), what moved between JAX/Flax releases (`compat`), pytree helpers
(`pytree`), module paths (`naming`), argument checks (`validation`), tracing a function once
(`tracing`), and which parts of a model an override gives another policy (`overrides`)."""

"""Loss scaling: the loss scales (`loss_scale`), the finite check (`finite`), the optax
transformation's core (`optimizer`), its state (`state`) and what it checks it is given
(`checks`); the parts composed around the core (`parts`): the skip records (`records`, with
`leaf_flags`), gradient statistics (`gradient_stats`), spike skipping (`spikes`), float8 states
(`fp8_states`) and misuse warnings (`misuse`); the scaled-gradient helper (`scaled_grad`) and
reports and checks of a run (`diagnostics`)."""

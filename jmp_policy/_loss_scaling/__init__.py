"""Loss scaling: the loss scales (`loss_scale`), the finite check (`finite`), the optax
transformation (`optimizer`) and its state (`state`), the scaled-gradient helper
(`scaled_grad`), reports and checks (`diagnostics`), spike skipping (`spikes`), misuse warnings
(`misuse`), per-leaf flags (`leaf_flags`) and gradient statistics (`gradient_stats`)."""

"""float8: formats, scales and the quantizing cast (`scaling`), delayed scaling (`delayed`) and
its state as model state (`state`)."""

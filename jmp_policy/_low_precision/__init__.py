"""16-bit parameters and optimizer moments: the optimizer (`optimizer`), the roundings it
applies (`rounding`) and the check that a 16-bit moment follows its gradients (`stall_check`)."""

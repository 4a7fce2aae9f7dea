"""autocast: the transforms (`transforms`), the function they return (`call`), the rules and an
evaluation's records (`evaluation`), one operation under the rules (`ops`), a program and its
sub-programs (`programs`), and the kinds of values (`activations`)."""

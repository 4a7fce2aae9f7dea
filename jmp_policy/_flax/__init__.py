"""What the Flax integrations do to Flax's layers (`layers`), Linen's module paths
(`linen_paths`), NNX's skipped steps (`nnx_skip`), Flax serialization of this library's states
(`serialization`) and float8 delayed scaling in Flax layers (`fp8_layers`)."""

"""Built-in workloads: small but realistic training steps, one per architecture family."""

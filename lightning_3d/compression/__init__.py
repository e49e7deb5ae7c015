"""Optimus-CC communication compression: CB + LEP (activation gradients), SC (data-parallel gradients through batched
PowerSGD), the Cholesky-QR orthonormalisation they share, and their options. See docs/architecture.md."""

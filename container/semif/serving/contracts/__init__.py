"""Wire contracts: each validates its own request shape, maps it to engine questions, and maps the
engine's distributions back. No contract imports another."""

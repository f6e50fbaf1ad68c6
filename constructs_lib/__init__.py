"""Reusable CDK constructs for SemIf: each module owns one concern."""

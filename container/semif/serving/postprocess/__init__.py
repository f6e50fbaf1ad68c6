"""What runs after scoring: calibration of the option logits and the abstention policy.

Pure functions of an answer; imports only the engine's plan and prompt definitions."""

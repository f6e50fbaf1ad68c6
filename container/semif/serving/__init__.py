"""What runs in the SageMaker image: HTTP, admission control, contracts, prompt and engine."""

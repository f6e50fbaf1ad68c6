"""Operator tools that run outside the image: model packaging, client, evaluation, calibration, batch jobs."""

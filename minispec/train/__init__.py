"""Training scripts: distilled drafters (``python -m minispec.train.distill_draft``)."""

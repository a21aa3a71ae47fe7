"""Training the demo checkpoint from scratch on the demo world (`h3serve train-demo`)."""

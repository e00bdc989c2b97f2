"""repmlp.deploy.precision."""

"""The fleet tier: an S3 object store shared by boxes serving the same model files."""

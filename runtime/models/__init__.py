"""Model forwards (torch) for the architectures ktrun serves."""

"""Test-only input builders (hostile data the product must survive); the demo's data is encode/sample_data."""

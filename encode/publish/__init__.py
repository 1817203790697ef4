"""Publishing a dataset version once every partition is done, and gc of what no kept version needs."""

"""The embedded task families and RST's operations (recursive extension) with its mechanical audit; data.py builds
the pools from them."""

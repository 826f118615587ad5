"""Load tests of a running server (`pagemill bench serve`)."""

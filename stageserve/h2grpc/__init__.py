"""A gRPC server on its own HTTP/2 (see server.py for why)."""

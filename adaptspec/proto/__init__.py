"""Generated gRPC stubs (``make protos``); never edited by hand."""

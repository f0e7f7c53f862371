"""Generated from protos/ by stageserve.protogen."""

"""Private descriptor pool for StageServe's generated protos (see protogen)."""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()

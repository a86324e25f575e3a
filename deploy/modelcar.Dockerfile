# An OCI "modelcar" holding a goinfer zoo store, for an InferenceService's storageUri: oci://REGISTRY/NAME:TAG.
# KServe runs it beside the server and shares its /models folder as /mnt/models.
#   goinfer zoo build --models qwen2.5-coder-0.5b -o zoo
#   docker build -f deploy/modelcar.Dockerfile -t registry.example/goinfer-zoo:qwen2.5-coder-0.5b .
FROM busybox:1.36
COPY zoo/ /models/
USER 1000

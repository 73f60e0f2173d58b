"""Offline checks of deploy/: the kustomize overlays, the images and the workers' init container
(`cgx-ps wait-for-shards`).

Every overlay is rendered with the real kustomize (`kubectl kustomize`, or a standalone
`kustomize build`; without either the rendering tests skip) from a copy of deploy/ in which
the inputs a user creates and never commits (the bearer token file) hold dummy values. Each
rendered object is validated against the Kubernetes OpenAPI schemas (kubernetes-validate,
strict: no unknown fields) for the oldest supported and the newest packaged Kubernetes
version; cert-manager's custom resources have no schema there and are checked field by field
instead. The rest are the checks a schema cannot make: labels and selectors agree, numbers
agree with the one ConfigMap they come from, the shard command parses with the real cgx-ps
CLI, the worker command with torchrun and the training script, the NetworkPolicies admit
exactly the intended traffic, every pod mounts the token and TLS Secrets read-only, no secret
is committed, and so on.

By subject: test_render (rendering, schemas, selectors, Services), test_commands (the one
ConfigMap and the commands it feeds), test_pods (resources, pod security), test_images,
test_network (NetworkPolicies), test_token and test_tls (the Secrets), test_wait_for_shards
(the init container) and test_real_shard (a shard started from the manifests). What they share
is here once: manifests (rendering, lookups), kubelet (a container's environment, arguments and
Secret files), dockerfiles, netpol (NetworkPolicy semantics), certificates, and conftest (a
throwaway PKI).
"""

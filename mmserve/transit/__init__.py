"""A request's travel between the tiers: the ZMQ links between ingress, engine clients and preprocessor replicas, what each carries, routing to an engine, and admission.

- `sockets`: the inbox each side binds and the outboxes that connect to it, the stuff of every link;
- `engine_link`: what an ingress replica and an engine client send each other; `engine_outputs`, the
  ingress's end of an engine client's output stream;
- `preprocessing_link`: what an engine client and a preprocessor replica send each other (the pixels
  named in the object store); `preprocessing_client` and `preprocessing_server`, its two ends;
  `replica_admission`, the jobs a preprocessor replica takes at once;
- `router`: which engine serves a request (`affinity`), and retries before its first output;
  `pending_images`, a request's images on their way.

Nothing here imports Ray: the deployments (`deployments/`) give these classes their Ray sides.
"""

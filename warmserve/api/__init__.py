"""warmserve's API types: where the components meet.

The operator, the node agent and the gateway never import each other; what one writes and
another reads is defined here, once:

* :mod:`.crd`: the ModelDeployment and GPUNode custom resources (group, version, kinds,
  plurals), their typed specs and defensive parser, and the one-deployment-per-model rule;
* :mod:`.demand`: the ``/demand`` report a gateway replica serves and the operator reads;
* :mod:`.history`: the load-history ConfigMap the operator keeps (and ``warmserve up`` seeds);
* :mod:`.agent`: the node agent's gRPC API (``warmserve.agent.v1``): the generated code, the
  wire enums and their policy-side values, the client, and the errors that cross it.

Pure data and parsing over the control and policy layers: nothing here knows a component.
"""

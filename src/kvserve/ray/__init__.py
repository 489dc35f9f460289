"""kvserve on Ray Serve (the optional extra `kvserve[ray]`): model
replicas across a Ray cluster behind an OpenAI ingress, routed by kvserve's
router and scaled by kvserve's autoscaling policy. Modules here import the
`ray` package (absolute imports: this package's own name never shadows it)."""

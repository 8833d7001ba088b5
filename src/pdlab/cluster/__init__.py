"""The cluster tier: the same lab spec rendered for SageMaker HyperPod, Kubernetes and plain GPU hosts."""

"""Two nodes on one machine: network namespaces joined by a shaped veth link."""

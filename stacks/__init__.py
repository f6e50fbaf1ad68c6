"""Deployable units. Each stack composes constructs from ``constructs_lib`` and wires grants and outputs."""

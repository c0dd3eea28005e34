"""The control plane's state: the records, the cluster that holds them, the verbs that change a replica."""

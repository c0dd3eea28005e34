"""The control plane's state: the records, the cluster that holds them, and the verbs that change a replica."""

"""The nodes controller: lost nodes, mass silence, fencing and drains."""

"""The nouns of a net: errors, random streams, blobs, the layer contract and registry,
fillers, the Net and the pure passes that build it. Imports nothing above itself."""

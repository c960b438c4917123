"""Files in and out: prototxt text and binary, the V0/V1 upgrades, weights
(.caffemodel and HDF5). Imports only cct.core.errors and cct.proto (a weight
file is read into a Net by duck typing)."""

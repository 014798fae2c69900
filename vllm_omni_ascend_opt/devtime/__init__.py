"""The device-time lab: an op trace of the real model at full scale with no memory (:mod:`.trace`), a device-time
model calibrated on the reference's published figures (:mod:`.model`), and multi-card layouts (:mod:`.layouts`).
Every figure it prints is a model, labelled as one. The plugin core never imports it."""

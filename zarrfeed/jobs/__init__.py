"""Jobs, sensors and schedules: a family's own (its build job, discovery sensor and nightly
schedule, made from its declaration) and the store-wide ones."""

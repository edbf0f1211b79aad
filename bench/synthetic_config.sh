# Sourced by the bench scripts that run DummyTrainer clients of a synthetic
# f32 model (netem, soak, server_core, mpi_netns, compress_links).
#
#   write_synthetic_config PATH PARAMS [LINE…]
#
# writes the experiment to PATH: DummyTrainer (update scale 0.001), a
# synthetic model of PARAMS parameters, and under server_configs each LINE
# as given (two spaces added; nest with more: "  grpc_configs:").
write_synthetic_config() {
  local path=$1 params=$2 line
  shift 2
  {
    printf 'client_configs:\n  train_configs:\n    trainer: DummyTrainer\n    dummy_update_scale: 0.001\n'
    printf '  model_configs:\n    model_name: synthetic\n    model_kwargs:\n      num_params: %s\n' "$params"
    printf 'server_configs:\n'
    for line in "$@"; do printf '  %s\n' "$line"; done
  } > "$path"
}

{
  description = "fused-mlp: RMSNorm, gated-activation MLP and addmm-with-bias kernels for the kernels Hub";

  inputs = {
    kernel-builder.url = "github:huggingface/kernels";
  };

  outputs =
    { self, kernel-builder }:
    kernel-builder.lib.genKernelFlakeOutputs {
      inherit self;
      path = ./.;

      # Dependencies of the test closure (`nix build .#ci-test`, `nix develop .#test`).
      pythonCheckInputs =
        pkgs: with pkgs; [
          hypothesis
          pytest
          transformers
        ];
    };
}

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

      # The test closure (`nix build .#ci-test`, `nix develop .#test`) runs `pytest tests -m kernels_ci`, but
      # pytest imports every test module first: each third-party module a test imports at module level must be
      # here (torch and pytest come with kernel-builder; kernels only with recent ones, so it is listed too).
      # tests/packaging/test_release.py checks this list.
      pythonCheckInputs =
        pkgs: with pkgs; [
          hypothesis
          kernels
          transformers
        ];
    };
}

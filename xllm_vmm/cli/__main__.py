from xllm_vmm.cli import main

main()

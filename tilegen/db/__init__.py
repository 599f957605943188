def tuned_rows(spec, device, template_hash, triton_version):
    return {}

//! Runs the example end to end, so that it cannot rot: it must exit 0 (every effect once).

#[test]
fn the_embedded_pipeline_delivers_every_effect_once() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_embedded-pipeline"))
        .env("ORDERS", "20")
        .output()
        .expect("the example starts");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("every effect happened once"), "{stdout}");
}

//! The README's architecture table is the registry: generated from
//! [`mlxcel_arch::registry_markdown`], checked here (`MLXCEL_BLESS=1` rewrites it).

const BEGIN: &str = "<!-- registry:begin -->\n";
const END: &str = "<!-- registry:end -->";

#[test]
fn readme_lists_the_registry() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .join("README.md");
    let readme = std::fs::read_to_string(&path).expect("README.md");
    let start = readme
        .find(BEGIN)
        .expect("the README has a registry:begin marker")
        + BEGIN.len();
    let end = readme
        .find(END)
        .expect("the README has a registry:end marker");
    let want = mlxcel_arch::registry_markdown();
    if std::env::var_os("MLXCEL_BLESS").is_some() {
        let updated = format!("{}{want}{}", &readme[..start], &readme[end..]);
        std::fs::write(&path, updated).expect("writing README.md");
        return;
    }
    assert_eq!(
        &readme[start..end],
        want,
        "README.md's architecture table differs from the registry: rerun this test with MLXCEL_BLESS=1"
    );
    // Every registered type is listed (and `mlxcel arch` prints the same descriptors).
    for d in mlxcel_arch::DESCRIPTORS {
        assert!(readme[start..end].contains(&format!("| {} |", d.model_type.name())));
    }
}

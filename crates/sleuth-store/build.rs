// `sqlx::migrate!` embeds migrations/ at compile time; a changed or added
// migration must rebuild the crate.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}

fn main() -> anyhow::Result<()> {
    muster::cli::main()
}

//! Tables as kubectl prints them, for every command that prints columns.

use comfy_table::{Table, presets};

/// Columns as kubectl prints them: upper-case headers, no borders, three spaces apart.
pub fn plain(header: Vec<&str>) -> Table {
    let mut table = Table::new();
    table.load_style(presets::NOTHING);
    table.set_header(header);
    for column in table.column_iter_mut() {
        column.set_padding((0, 3));
    }
    table
}

/// `table`'s lines, each after `indent` and without trailing blanks.
pub fn indented(table: &Table, indent: &str) -> String {
    table
        .lines()
        .map(|line| format!("{indent}{}\n", line.trim_end()))
        .collect()
}

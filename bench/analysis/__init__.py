"""Reading results: comparisons with statistics (`compare`, `stats`, `report`), `bench ab`, history with its
change points (`history`, `steps`), the CI baseline and the roofline model of cards that are not here."""

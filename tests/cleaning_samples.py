"""Three documents the cleaning tests share (tests/unit/data and tests/unit/tools): clean English prose, clean
Chinese prose and prose with code, each of which every cleaning step must keep."""

EN = (
    "The library opened its new reading room on Saturday, and by noon every one of the forty seats was taken. "
    "Most of the visitors had come for the exhibition of old maps, which the city bought from a private "
    "collector in 1998 and has kept in storage ever since.\n\n"
    "The maps show the harbour as it was before the river was moved, with the old fish market and the ropewalk "
    "that gave the street its name. A guide explained how the surveyors worked with chains and compasses, and "
    "why some of the streets on the maps were never built.\n\n"
    "The exhibition runs until the end of March. Entry is free, but the library asks visitors to book a time "
    "on its website, because the room is small and the maps are fragile."
)
ZH = (
    "上周六，市图书馆的新阅览室正式开放，不到中午，四十个座位就已经坐满了。大多数读者是为了看古地图展览而来的，"
    "这批地图是市政府在一九九八年从一位私人收藏家手中买下的，此后一直保存在库房里。\n\n"
    "这些地图展示了河道改道之前港口的样子，上面还能看到旧鱼市和制绳场，这条街的名字就是由此而来。讲解员介绍了"
    "当年测绘人员如何用测链和罗盘工作，也解释了为什么地图上的一些街道最终没有修建。\n\n"
    "展览将持续到三月底。参观免费，但图书馆请大家提前在网站上预约时间，因为阅览室面积不大，地图也很脆弱。"
)
CODE = (
    "To read a file line by line, open it in a with block so that it is closed even if an error is raised:\n\n"
    "    with open(path, encoding='utf-8') as f:\n        for line in f:\n            print(line.rstrip())\n\n"
    "The loop reads one line at a time, so the whole file is never held in memory, which matters for logs of "
    "several gigabytes. See the documentation of the open function for the other modes and their meaning."
)
